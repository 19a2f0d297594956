"""Diffusion GGUF files written in the tests the way llama.cpp's converter writes them (``convert_hf_to_gguf.py``:
``LLaDAModel``, ``DreamModel``), with the ``gguf`` package's writer and its tensor-name map (``gguf.get_tensor_name_map``:
llama.cpp's names), from a Hugging Face directory in the family's own layout (tests/tiny.py's replicas).

Mirrors the converter: the hyper-parameters it writes (block_count, context_length, embedding_length,
feed_forward_length, head counts, rope.freq_base, rms epsilon; LLaDA: vocab_size, rope.dimension_count,
causal_attention false, diffusion.shift_logits false, add_bos_token; Dream: causal_attention false, mask_token_id),
the vocabulary as ``get_vocab_base`` lists it (``[PADi]`` for ids the tokenizer lacks, typed UNUSED; added special
tokens CONTROL), BPE merges, the special ids and the chat template; LLaDA's q/k rows permuted for llama.cpp's RoPE
(``LLaDAModel.permute``); 1-D tensors F32, matrices in the requested type.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

QTYPES = ("F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K")


def read_hf_state(hf_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(Path(hf_dir).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def permute_for_ggml(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LLaDAModel.permute`` (its ``n_head_kv`` argument already substituted)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """``w`` ``[rows, k]`` float32 (k a multiple of 256) as Q4_K blocks (``block_q4_K``: fp16 d, fp16 dmin, 12 bytes
    of 6-bit sub-block scales and mins, 128 bytes of 4-bit quants), rows ``[rows, k / 256 * 144]`` uint8. A plain
    min/max quantizer per sub-block of 32 (llama.cpp's ``make_qkx2_quants`` searches further; the layout is the
    same, which is what the reader is tested on)."""
    rows, k = w.shape
    b = w.reshape(rows, k // 256, 8, 32).astype(np.float32)
    lo = np.minimum(b.min(-1), 0.0)
    scale = (b.max(-1) - lo) / 15.0
    d = (scale.max(-1) / 63.0).astype(np.float16).astype(np.float32)
    dmin = ((-lo).max(-1) / 63.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.round(scale / np.where(d == 0, 1, d)[..., None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / np.where(dmin == 0, 1, dmin)[..., None]), 0, 63).astype(np.uint8)
    eff_s = d[..., None] * sc
    eff_m = dmin[..., None] * mn
    q = np.clip(np.round((b + eff_m[..., None]) / np.where(eff_s == 0, 1, eff_s)[..., None]), 0, 15).astype(np.uint8)
    scales = np.zeros((rows, k // 256, 12), dtype=np.uint8)  # get_scale_min_k4's packing
    scales[..., 0:4] = (sc[..., 0:4] & 63) | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = (mn[..., 0:4] & 63) | ((mn[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 15) | ((mn[..., 4:8] & 15) << 4)
    qs = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).reshape(rows, k // 256, 128)  # pairs of sub-blocks share bytes
    head = np.stack([d, dmin], -1).astype(np.float16).view(np.uint8).reshape(rows, k // 256, 4)
    return np.concatenate([head, scales, qs], -1).reshape(rows, -1)


def _matrix(w: torch.Tensor, qtype: str):
    import gguf

    t = gguf.GGMLQuantizationType[qtype]
    a = w.float().numpy()
    if qtype == "F16":
        return a.astype(np.float16), t
    if qtype == "Q4_K":
        if a.shape[1] % 256:
            return a.astype(np.float16), gguf.GGMLQuantizationType.F16  # llama.cpp falls back too
        return quantize_q4_k(a), t
    return gguf.quants.quantize(a, t), t


def _vocab(tok, vocab_size: int):
    import gguf

    vocab = tok.get_vocab()
    reverse = {i: t for t, i in vocab.items()}
    added = tok.get_added_vocab()
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif reverse[i] in added:
            tokens.append(reverse[i])
            special = i in tok.added_tokens_decoder and tok.added_tokens_decoder[i].special
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(reverse[i])
            types.append(gguf.TokenType.NORMAL)
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in merges]
    return tokens, types, merges


def _write_vocab(w, tok, cfg: dict, llada: bool) -> None:
    """The converter's ``_set_vocab_gpt2``: BPE vocabulary, token types, merges, special ids, chat template."""
    tokens, types, merges = _vocab(tok, cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if cfg.get("eos_token_id") is not None:
        w.add_eos_token_id(cfg["eos_token_id"])
    if cfg.get("pad_token_id") is not None:
        w.add_pad_token_id(cfg["pad_token_id"])
    if cfg.get("mask_token_id") is not None:
        w.add_mask_token_id(cfg["mask_token_id"])
    if llada:
        w.add_add_bos_token(True)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)


def write_diffusion_gguf(hf_dir: Path, out: Path, arch: str, qtype: str = "F16") -> Path:
    """``hf_dir`` (a LLaDA or Dream replica) as a GGUF of ``arch`` (``llada`` | ``dream``) at ``out``, matrices in
    ``qtype`` (one of :data:`QTYPES`)."""
    import gguf
    from transformers import PreTrainedTokenizerFast

    cfg = json.loads((Path(hf_dir) / "config.json").read_text())
    tok = PreTrainedTokenizerFast.from_pretrained(str(hf_dir))
    state = read_hf_state(hf_dir)
    if arch == "llada-moe":
        state = merge_experts(state)
    llada = arch == "llada"
    n_layers = cfg["n_layers"] if llada else cfg["num_hidden_layers"]  # Dream and LLaDA-MoE: Qwen's keys
    d = cfg["d_model"] if llada else cfg["hidden_size"]
    n_head = cfg["n_heads"] if llada else cfg["num_attention_heads"]
    n_kv = cfg["n_kv_heads"] if llada else cfg["num_key_value_heads"]
    vocab_size = cfg["vocab_size"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("tiny")
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_sequence_length"] if llada else cfg["max_position_embeddings"])
    w.add_embedding_length(d)
    w.add_feed_forward_length(cfg["mlp_hidden_size"] if llada else cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_file_type({"F16": 1, "Q8_0": 7, "Q4_0": 2, "Q4_1": 3, "Q4_K": 15}[qtype])
    w.add_causal_attention(False)
    if llada:
        w.add_vocab_size(vocab_size)
        w.add_rope_dimension_count(d // n_head)
        w.add_diffusion_shift_logits(False)
    if arch == "llada-moe":  # LLaDAMoEModel.set_gguf_parameters and the base class's expert keys
        w.add_expert_count(cfg["num_experts"])
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["expert_intermediate_size"])
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
        w.add_diffusion_shift_logits(False)
    _write_vocab(w, tok, cfg, llada)
    model_arch = {"llada": gguf.MODEL_ARCH.LLADA, "dream": gguf.MODEL_ARCH.DREAM, "llada-moe": gguf.MODEL_ARCH.LLADA_MOE}
    name_map = gguf.get_tensor_name_map(model_arch[arch], n_layers)
    for name in sorted(state, key=_tensor_order):
        t = state[name].float()
        if llada and name.endswith("q_proj.weight"):
            t = permute_for_ggml(t, n_head)
        elif llada and name.endswith("k_proj.weight"):
            t = permute_for_ggml(t, n_kv)
        new = name_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert new is not None, name
        if t.dim() == 1:
            w.add_tensor(new, t.numpy().astype(np.float32))
        elif t.dim() == 3:  # merged experts: each [out, in] matrix in the requested type
            parts = [_matrix(e, qtype) for e in t]
            w.add_tensor(new, np.stack([p[0] for p in parts]), raw_dtype=parts[0][1])
        else:
            data, raw = _matrix(t, qtype)
            w.add_tensor(new, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def merge_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``mlp.experts.E.<proj>.weight`` stacked into ``mlp.experts.<proj>.weight`` ``[E, ...]``, as
    ``LLaDAMoEModel.modify_tensors`` does before naming them."""
    import re

    out, groups = {}, {}
    for name, t in state.items():
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+)\.weight", name)
        if m:
            groups.setdefault(f"{m.group(1)}.{m.group(3)}.weight", {})[int(m.group(2))] = t
        else:
            out[name] = t
    for name, parts in groups.items():
        out[name] = torch.stack([parts[e] for e in sorted(parts)])
    return out


def _tensor_order(name: str):
    import re

    m = re.search(r"\.(\d+)\.", name)
    return (int(m.group(1)) if m else -1, name)
