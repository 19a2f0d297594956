"""Diffusion GGUF files (issue 45, docs/design.md#model-families "GGUF files"): a tiny LLaDA, Dream and LLaDA-MoE, saved
in their own Hugging Face layout, written as GGUF with llama.cpp's names (tests/gguf_files.py: the ``gguf`` package's
writer and tensor-name map, the converter's metadata), decode token for token as the directory they came from; the
quantized files as the directory of their dequantized weights, their 4-bit layers through int4; ``unmask convert
FILE.gguf OUT`` gives back the directory; bad files are refused in one line.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gguf_files import read_hf_state, write_diffusion_gguf
from tiny import family_tokenizer, llada_config_dict, llada_replica_state_dict, save_foreign_checkpoint

V = 336  # embedding rows past the tokenizer's 322-323 tokens, as published vocabularies are rounded up
D = 256  # wide enough for Q4_K's super-blocks of 256


def _fp16(state: dict) -> dict:
    """Weights as a checkpoint published in half precision holds them (what an F16 GGUF stores exactly)."""
    return {k: v.half().float() for k, v in state.items()}


def _write_llada(out: Path):
    tok = family_tokenizer(["<|eot_id|>", "<|mdm_mask|>"])
    cfg = llada_config_dict(V, eos_token_id=0, mask_token_id=tok.convert_tokens_to_ids("<|mdm_mask|>"), d_model=D,
                            n_heads=8, n_kv_heads=4, mlp_hidden_size=2 * D)
    save_foreign_checkpoint(out, _fp16(llada_replica_state_dict(cfg, seed=21)), cfg, tok,
                            tokenizer_config_updates={"tokenizer_class": "PreTrainedTokenizerFast"})
    return tok


def _write_dream(out: Path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = family_tokenizer(["<|mask|>"])
    torch.manual_seed(22)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=V, hidden_size=D, intermediate_size=2 * D, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
                                         rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False))
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.normal_(0.0, 0.5)
    cfg = {"architectures": ["DreamModel"], "model_type": "Dream", "hidden_act": "silu", "hidden_size": D,
           "intermediate_size": 2 * D, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4,
           "max_position_embeddings": 512, "rope_theta": 1e6, "rms_norm_eps": 1e-6, "vocab_size": V,
           "tie_word_embeddings": False, "use_sliding_window": False, "eos_token_id": 0, "pad_token_id": 0,
           "mask_token_id": tok.convert_tokens_to_ids("<|mask|>")}
    save_foreign_checkpoint(out, _fp16(model.state_dict()), cfg, tok,
                            tokenizer_config_updates={"tokenizer_class": "PreTrainedTokenizerFast"})
    return tok


MOE = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
       "num_experts": 4, "num_experts_per_tok": 2, "expert_intermediate_size": 32, "intermediate_size": 64}


def _moe_state(seed: int) -> dict:
    """Random LLaDA-MoE weights in its own layout (per-expert tensors), head scaled for a decisive argmax."""
    g = torch.Generator().manual_seed(seed)
    h, hd, E, inter = MOE["hidden_size"], MOE["head_dim"], MOE["num_experts"], MOE["expert_intermediate_size"]
    q, kv = MOE["num_attention_heads"] * hd, MOE["num_key_value_heads"] * hd

    def lin(o, i, scale=1.0):
        return torch.randn(o, i, generator=g) * scale / i ** 0.5

    sd = {"model.embed_tokens.weight": torch.randn(V, h, generator=g), "model.norm.weight": 1 + 0.1 * torch.randn(h, generator=g),
          "lm_head.weight": lin(V, h, 8.0)}
    for i in range(MOE["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd.update({p + "input_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                   p + "post_attention_layernorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
                   p + "self_attn.q_proj.weight": lin(q, h, 3.0), p + "self_attn.k_proj.weight": lin(kv, h, 3.0),
                   p + "self_attn.v_proj.weight": lin(kv, h), p + "self_attn.o_proj.weight": lin(h, q),
                   p + "self_attn.q_norm.weight": 1 + 0.2 * torch.randn(hd, generator=g),
                   p + "self_attn.k_norm.weight": 1 + 0.2 * torch.randn(hd, generator=g),
                   p + "mlp.gate.weight": lin(E, h, 4.0)})
        for e in range(E):
            sd.update({p + f"mlp.experts.{e}.gate_proj.weight": lin(inter, h), p + f"mlp.experts.{e}.up_proj.weight": lin(inter, h),
                       p + f"mlp.experts.{e}.down_proj.weight": lin(h, inter)})
    return _fp16(sd)


def _write_llada_moe(out: Path):
    tok = family_tokenizer(["<|role_end|>", "<|mask|>"])
    cfg = {"architectures": ["LLaDAMoEModelLM"], "model_type": "lladamoe", "vocab_size": V, "rope_theta": 50000.0,
           "rms_norm_eps": 1e-6, "max_position_embeddings": 512, "tie_word_embeddings": False, "norm_topk_prob": False,
           "eos_token_id": 0, "pad_token_id": 0, "mask_token_id": tok.convert_tokens_to_ids("<|mask|>"), **MOE}
    save_foreign_checkpoint(out, _moe_state(23), cfg, tok,
                            tokenizer_config_updates={"tokenizer_class": "PreTrainedTokenizerFast"})
    return tok


WRITERS = {"llada": _write_llada, "dream": _write_dream, "llada_moe": _write_llada_moe}
ARCH = {"llada": "llada", "dream": "dream", "llada_moe": "llada-moe"}
#: the files each family is tested in (LLaDA-MoE's tiny width is below Q4_K's rows of 256: it would be F16)
QTYPES_OF = {"llada": ("F16", "Q8_0", "Q4_0", "Q4_K"), "dream": ("F16", "Q8_0", "Q4_K"), "llada_moe": ("F16", "Q8_0")}


def _quantized_values(t: torch.Tensor, qtype: str) -> torch.Tensor:
    """A matrix as a ``qtype`` GGUF holds it (quantized as the writer does, dequantized by the ``gguf`` package).
    Blocks run along a row, so LLaDA's q/k row permutation commutes with it."""
    import gguf
    import numpy as np

    from gguf_files import _matrix

    data, raw = _matrix(t, qtype)
    return torch.from_numpy(np.array(gguf.quants.dequantize(data, raw), dtype=np.float32)).reshape(t.shape)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``(family, qtype) -> (gguf file, HF directory it must match)``; for quantized files that directory holds
    the file's values (each matrix quantized and dequantized), written beside the original."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for family, write in WRITERS.items():
        hf = root / family
        tok = write(hf)
        cfg = json.loads((hf / "config.json").read_text())
        for qtype in QTYPES_OF[family]:
            f = write_diffusion_gguf(hf, root / f"{family}-{qtype}.gguf", ARCH[family], qtype)
            twin = hf
            if qtype != "F16":
                twin = root / f"{family}-{qtype}-values"
                state = {k: t if t.dim() == 1 else _quantized_values(t, qtype) for k, t in read_hf_state(hf).items()}
                save_foreign_checkpoint(twin, state, cfg, tok,
                                        tokenizer_config_updates={"tokenizer_class": "PreTrainedTokenizerFast"})
            out[family, qtype] = (f, twin)
    return out


def _generate(path, weights="native", **params):
    from unmask.engine import LLM, SamplingParams
    from unmask.engine.model import load_model

    lm = load_model(path, device="cpu", dtype="float32", weights=weights)
    prompt = lm.tokenizer("What is the capital of France?").input_ids
    kw = dict(max_tokens=16, temperature=0.0, seed=0, ignore_eos=True, block_size=8)
    kw.update(params)
    out = LLM(lm).generate([prompt], SamplingParams(**kw))[0].outputs[0]
    return lm, prompt, out.token_ids


@pytest.mark.parametrize("family", list(WRITERS))
def test_f16_gguf_decodes_as_its_directory(family, files):
    """Same settings, greedy: the F16 GGUF and the HF directory it was written from give the same tokens, with the
    family, mask token, EOS, attention, logit shift and chat template read from the file's metadata."""
    f, hf = files[family, "F16"]
    a, pa, ta = _generate(hf)
    b, pb, tb = _generate(f)
    assert pa == pb  # the tokenizer built from the GGUF's vocabulary and merges
    assert ta == tb and len(tb) == 16
    for key in ("family", "mask_token_id", "attention", "logit_shift", "eos_token_ids", "block_size",
                "suppress_token_ids"):
        assert getattr(b.dllm, key) == getattr(a.dllm, key), key
    assert b.tokenizer.chat_template == a.tokenizer.chat_template
    ids = torch.tensor([pa + [a.dllm.mask_token_id] * 4])
    pos = torch.arange(ids.shape[1])[None]
    full = torch.ones(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool)
    la = a.logits(a.hidden_states(ids, pos, full))
    lb = b.logits(b.hidden_states(ids, pos, full))
    torch.testing.assert_close(lb, la, atol=1e-5, rtol=0)  # the same weights: LLaDA's q/k permutation undone


@pytest.mark.parametrize(("family", "qtype"), [(f, q) for f, qs in QTYPES_OF.items() for q in qs if q != "F16"])
def test_quantized_gguf_decodes_as_its_values(family, qtype, files):
    """Q8_0 / Q4_0 / Q4_K: the file decodes as the directory of its own (dequantized) values, natively and with the
    default packing; the 4-bit files' linear layers run int4 (every layer on the grid), the Q8_0 file's fp16."""
    f, values = files[family, qtype]
    assert _generate(f)[2] == _generate(values)[2]
    lm, _, tokens = _generate(f, weights="auto")
    assert tokens == _generate(values, weights="auto")[2]
    from unmask.engine.gguf_file import GGUFFile

    if GGUFFile(f).tensor_type("blk.0.attn_q.weight").startswith("Q4"):  # Q4_K needs rows of 256 (else F16)
        assert lm.weight_format == "int4"
        per_layer = 2 if family == "llada_moe" else 4  # fused qkv, o (+ fused gate|up, down); experts stay native
        assert lm.packed_layers.get("int4", 0) >= 2 * per_layer
    else:
        assert lm.weight_format != "int4" and qtype != "Q4_0"


@pytest.mark.parametrize("family", list(WRITERS))
def test_convert_gives_back_the_directory(family, files, tmp_path):
    """``unmask convert FILE.gguf OUT`` writes the family's own layout (config keys, tensor names), tensors equal to
    the directory's, and OUT decodes as the file."""
    from unmask.cli.main import main

    f, hf = files[family, "F16"]
    out = tmp_path / "out"
    assert main(["convert", str(f), str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == json.loads((hf / "config.json").read_text())["architectures"]
    got, want = read_hf_state(out), read_hf_state(hf)
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], atol=0, rtol=0)
    assert _generate(out)[2] == _generate(f)[2]


def _refusal(path) -> str:
    from unmask.engine.config import CheckpointError
    from unmask.engine.model import load_model

    with pytest.raises(CheckpointError) as exc:
        load_model(path, device="cpu", dtype="float32", weights="native")
    msg = str(exc.value)
    assert "\n" not in msg and str(path) in msg
    return msg


def test_truncated_and_corrupt_files_are_refused_in_one_line(files, tmp_path):
    data = files["llada", "F16"][0].read_bytes()
    for name, blob in (("half", data[: len(data) // 2]), ("header", data[:200]), ("magic", data[:4]),
                       ("garbage", b"GGUF" + bytes(range(256)) * 8)):
        p = tmp_path / f"{name}.gguf"
        p.write_bytes(blob)
        assert "corrupt or truncated GGUF" in _refusal(p), name
    p = tmp_path / "not.gguf"
    p.write_bytes(b"PK\x03\x04" + data[4:])
    assert "not a GGUF file" in _refusal(p) or "not a directory" in _refusal(p)


def _metadata_variant(src: Path, out: Path, arch: str | None = None, drop_tensor: str | None = None,
                      set_kv: dict | None = None) -> Path:
    """A copy of ``src`` with another architecture name, a tensor left out or a metadata value changed (the
    ``gguf`` package's reader and writer)."""
    import gguf

    from unmask.engine.gguf_file import GGUFFile

    g = GGUFFile(src)
    new_arch = arch or g.get("general.architecture")
    w = gguf.GGUFWriter(str(out), new_arch)
    old_arch = g.get("general.architecture")
    for key, value in g.metadata.items():
        if key in ("general.architecture",):
            continue
        key = key.replace(f"{old_arch}.", f"{new_arch}.", 1) if key.startswith(f"{old_arch}.") else key
        if set_kv and key in set_kv:
            value = set_kv[key]
        field = g._reader.fields[key if not key.startswith(f"{new_arch}.") else key.replace(new_arch, old_arch, 1)]
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(key, value)
        else:
            w.add_key_value(key, value, vtype)
    for t in g._reader.tensors:
        if t.name == drop_tensor:
            continue
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_other_architectures_are_refused_naming_them(files, tmp_path):
    src = files["llada", "F16"][0]
    msg = _refusal(_metadata_variant(src, tmp_path / "rnd1.gguf", arch="rnd1"))
    assert "'rnd1' is a diffusion architecture unmask does not serve" in msg
    msg = _refusal(_metadata_variant(src, tmp_path / "llama.gguf", arch="llama"))
    assert "'llama' is not a diffusion architecture" in msg and "unmask convert" in msg


def test_missing_tensor_and_contradicting_metadata_are_named(files, tmp_path):
    src = files["llada", "F16"][0]
    msg = _refusal(_metadata_variant(src, tmp_path / "cut.gguf", drop_tensor="blk.1.ffn_down.weight"))
    assert "model.layers.1.mlp.down_proj.weight" in msg or "ff_out" in msg
    msg = _refusal(_metadata_variant(src, tmp_path / "shift.gguf", set_kv={"diffusion.shift_logits": True}))
    assert "diffusion.shift_logits" in msg
    msg = _refusal(_metadata_variant(src, tmp_path / "causal.gguf", set_kv={"llada.attention.causal": True}))
    assert "llada.attention.causal" in msg


def test_llada_moe_matches_transformers_qwen3_moe(files):
    """The LLaDA-MoE architecture (llama.cpp's llada-moe graph: per-head q/k norms, NeoX RoPE, softmax top-k without
    renormalising, SwiGLU experts) as unmask loads it gives the logits of transformers' own Qwen3MoeForCausalLM
    holding the same weights (its router and experts, not engine/moe.py), bidirectionally."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from unmask.engine.model import load_model

    f, hf = files["llada_moe", "F16"]
    state = read_hf_state(hf)
    cfg = Qwen3MoeConfig(vocab_size=V, hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_experts=4,
                         num_experts_per_tok=2, norm_topk_prob=False, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rope_theta=50000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    ref = Qwen3MoeForCausalLM(cfg).eval()
    sd = {k: v for k, v in state.items() if ".experts." not in k}
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts."
        sd[p + "gate_up_proj"] = torch.stack([torch.cat([state[p + f"{e}.gate_proj.weight"],
                                                         state[p + f"{e}.up_proj.weight"]]) for e in range(4)])
        sd[p + "down_proj"] = torch.stack([state[p + f"{e}.down_proj.weight"] for e in range(4)])
    ref.load_state_dict(sd, strict=True)
    ids = torch.tensor([[5, 17, 42, 99, 7, 300, 12, 64]])
    full = torch.ones(1, 1, 8, 8, dtype=torch.bool)  # bidirectional
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=full).logits
    for path in (hf, f):
        lm = load_model(path, device="cpu", dtype="float32", weights="native")
        got = lm.logits(lm.hidden_states(ids, torch.arange(8)[None], full))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
