"""Diffusion checkpoints stored as GGUF (llama.cpp's converter, ``convert_hf_to_gguf.py``: ``LLaDAModel``,
``DreamModel``, ``LLaDAMoEModel``), read back into the Hugging Face checkpoint they were converted from
(docs/design.md#model-families, "GGUF files").

transformers' GGUF loader knows no ``llada``, ``dream`` or ``llada-moe`` architecture, so the mapping is here. It is
the converter run backwards: llama.cpp's tensor names (gguf-py ``tensor_mapping.py``) become the family's own names
(LLaDA's ``model.transformer.*``, Dream's Qwen2 names) and the GGUF metadata (``{arch}.block_count``,
``{arch}.attention.head_count``, ...) becomes the family's ``config.json`` keys, so that the family adapter
(:mod:`.llada`, :mod:`.dream`) loads the result exactly as it loads the original directory:

=================================  ==========================================  ===================================
GGUF (``blk.N.`` per layer)         LLaDA (``model.transformer.``)               Dream (Qwen2)
=================================  ==========================================  ===================================
``token_embd``                      ``wte``                                      ``model.embed_tokens``
``blk.N.attn_norm``                 ``blocks.N.attn_norm``                       ``model.layers.N.input_layernorm``
``blk.N.attn_q|k|v`` (+ ``.bias``)  ``blocks.N.q_proj|k_proj|v_proj`` (*)        ``...self_attn.q_proj|k_proj|v_proj``
``blk.N.attn_output``               ``blocks.N.attn_out``                        ``...self_attn.o_proj``
``blk.N.ffn_norm``                  ``blocks.N.ff_norm``                         ``...post_attention_layernorm``
``blk.N.ffn_gate|up|down``          ``blocks.N.ff_proj|up_proj|ff_out``          ``...mlp.gate_proj|up_proj|down_proj``
``output_norm``                     ``ln_f``                                     ``model.norm``
``output`` (absent: tied)           ``ff_out``                                   ``lm_head``
=================================  ==========================================  ===================================

LLaDA-MoE (``llada-moe``, :mod:`.llada_moe`) uses Dream's names plus ``blk.N.attn_q_norm|attn_k_norm`` ->
``self_attn.q_norm|k_norm``, ``blk.N.ffn_gate_inp`` -> ``mlp.gate`` and the merged experts ``blk.N.ffn_gate_exps|
ffn_up_exps|ffn_down_exps`` ``[E, ...]`` -> ``mlp.experts.E.gate_proj|up_proj|down_proj`` (split back per expert, as
the converter stacked them); its metadata adds ``expert_count``, ``expert_used_count``,
``expert_feed_forward_length`` and ``attention.key_length``.

(*) LLaDA's converter permutes q and k rows for llama.cpp's interleaved ("normal") RoPE (``LLaDAModel.permute``,
``undo_permute = True``: per head, rows ``[2, half]`` become ``[half, 2]``); reading undoes it. Dream uses NeoX
RoPE, as Qwen2 does: no permutation.

Metadata: the family is ``general.architecture``; the mask token ``tokenizer.ggml.mask_token_id`` (else the family's
mask token in the vocabulary, else its published id); the logit shift ``diffusion.shift_logits`` (llama.cpp's
default when absent: true, Dream; LLaDA writes false) and the attention ``{arch}.attention.causal`` (false) must
agree with the family's, else the file is refused naming the key; EOS, BOS, pad and the chat template come from
``tokenizer.*``, the tokenizer itself from the vocabulary and merges (transformers' GGUF tokenizer builder). GGUF
holds no block length (``llama-diffusion-cli --diffusion-block-length``): the family's default applies.

A ``llama.cpp`` diffusion architecture unmask does not serve (``rnd1``), an autoregressive GGUF (convert that with
``unmask convert``), a file without the tensors of its architecture or with tensors it does not have: one-line
:class:`CheckpointError`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import CheckpointError

#: ``general.architecture`` -> unmask family, for the diffusion architectures of llama.cpp served here
GGUF_FAMILIES = {"llada": "llada", "dream": "dream", "llada-moe": "llada_moe"}
#: llama.cpp's diffusion architectures (``llama_model_is_diffusion``) that unmask does not serve
UNSERVED_DIFFUSION = ("rnd1",)
DIFFUSION_ARCHS = (*GGUF_FAMILIES, *UNSERVED_DIFFUSION)

_LLADA_TOP = {"token_embd.weight": "model.transformer.wte.weight",
              "output_norm.weight": "model.transformer.ln_f.weight",
              "output.weight": "model.transformer.ff_out.weight"}
_LLADA_BLOCK = {"attn_norm": "attn_norm", "attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj",
                "attn_output": "attn_out", "ffn_norm": "ff_norm", "ffn_gate": "ff_proj", "ffn_up": "up_proj",
                "ffn_down": "ff_out"}
_QWEN_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
_QWEN_BLOCK = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
               "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
               "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
#: ``tokenizer.ggml.token_type`` of the ``[PADi]`` entries the converter writes for ids the tokenizer lacks
TOKEN_TYPE_UNUSED = 5
_MOE_BLOCK = dict(_QWEN_BLOCK, attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm", ffn_gate_inp="mlp.gate")
#: merged expert tensors ``[E, ...]`` (the converter stacks ``mlp.experts.E.*``), split back per expert
_MOE_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}
_BLK = re.compile(r"blk\.(\d+)\.([a-z_]+)\.(weight|bias)")


@dataclass
class GGUFCheckpoint:
    """A diffusion GGUF read back into its Hugging Face form: ``family``, ``config`` (the family's ``config.json``
    keys), ``state_dict`` (the family's tensor names, float32), ``tokenizer``, ``source`` (the file) and
    ``tensor_types`` (GGML type -> how many tensors, e.g. ``{"Q4_K": 12, "F32": 5}``)."""

    family: str
    config: dict
    state_dict: dict[str, torch.Tensor]
    tokenizer: object
    source: Path
    tensor_types: dict[str, int] = field(default_factory=dict)
    unused_ids: list[int] = field(default_factory=list)


def gguf_family(gguf) -> str:
    """The unmask family of an opened :class:`~unmask.engine.gguf_file.GGUFFile` from ``general.architecture``.

    Raises:
        CheckpointError: (one line) no architecture; a diffusion architecture unmask does not serve; an
            autoregressive one (names ``unmask convert``).
    """
    arch = gguf.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise CheckpointError(f"{gguf.path}: general.architecture is missing (not a model GGUF)")
    if arch in GGUF_FAMILIES:
        return GGUF_FAMILIES[arch]
    served = ", ".join(GGUF_FAMILIES)
    if arch in UNSERVED_DIFFUSION:
        raise CheckpointError(f"{gguf.path}: general.architecture {arch!r} is a diffusion architecture unmask does "
                              f"not serve (GGUF diffusion architectures served: {served})")
    raise CheckpointError(f"{gguf.path}: general.architecture {arch!r} is not a diffusion architecture (served: "
                          f"{served}); an autoregressive GGUF is converted first: unmask convert {gguf.path} OUT")


def read_diffusion_gguf(path: str | Path) -> GGUFCheckpoint:
    """Read a LLaDA / Dream / LLaDA-MoE GGUF into a :class:`GGUFCheckpoint` (tensors dequantized to float32).

    Raises:
        CheckpointError: (one line, naming the file and the key or tensor) see the module docstring.
    """
    from ..gguf_file import GGUFFile

    gguf = GGUFFile(path)
    family = gguf_family(gguf)
    arch = gguf.get("general.architecture")
    _check_diffusion_settings(gguf, arch, family)
    tokenizer = gguf_tokenizer(gguf)
    if family == "llada":
        config = llada_config(gguf, arch)
        state = _read_tensors(gguf, _LLADA_TOP, "model.transformer.blocks.{}.", _LLADA_BLOCK)
        _unpermute_qk(state, config["n_heads"], config["n_kv_heads"])
    elif family == "dream":
        config = dream_config(gguf, arch)
        state = _read_tensors(gguf, _QWEN_TOP, "model.layers.{}.", _QWEN_BLOCK)
    else:
        config = llada_moe_config(gguf, arch)
        state = _read_tensors(gguf, _QWEN_TOP, "model.layers.{}.", _MOE_BLOCK, _MOE_EXPERTS)
    _check_blocks(gguf, state, config, family)
    types: dict[str, int] = {}
    for name in gguf.tensor_names:
        types[gguf.tensor_type(name)] = types.get(gguf.tensor_type(name), 0) + 1
    token_types = gguf.get("tokenizer.ggml.token_type") or []
    unused = [i for i, t in enumerate(token_types) if t == TOKEN_TYPE_UNUSED]
    return GGUFCheckpoint(family=family, config=config, state_dict=state, tokenizer=tokenizer, source=Path(path),
                          tensor_types=types, unused_ids=unused)


def _check_diffusion_settings(gguf, arch: str, family: str) -> None:
    """The attention and logit shift the file states agree with the family's (module docstring)."""
    causal = gguf.get(f"{arch}.attention.causal")
    if causal is True:
        raise CheckpointError(f"{gguf.path}: {arch}.attention.causal is true, but {arch} is a bidirectional "
                              "diffusion model (llama.cpp's converter writes false)")
    shift = gguf.get("diffusion.shift_logits")
    want = family == "dream"
    if shift is not None and bool(shift) != want:
        raise CheckpointError(f"{gguf.path}: diffusion.shift_logits is {bool(shift)}, but {arch} "
                              f"{'shifts' if want else 'does not shift'} its logits")


def _require(gguf, key: str):
    value = gguf.get(key)
    if value is None:
        raise CheckpointError(f"{gguf.path}: metadata key {key} is missing")
    return value


def _common_shape(gguf, arch: str) -> dict:
    """Sizes every family reads: layers, width, heads, context, RoPE base, norm epsilon, vocabulary rows."""
    n_heads = int(_require(gguf, f"{arch}.attention.head_count"))
    d = int(_require(gguf, f"{arch}.embedding_length"))
    if "token_embd.weight" not in gguf.tensor_names:
        raise CheckpointError(f"{gguf.path}: tensor token_embd.weight is missing")
    rows = gguf.tensor_shape("token_embd.weight")[0]
    rope_dim = gguf.get(f"{arch}.rope.dimension_count")
    head = int(gguf.get(f"{arch}.attention.key_length") or d // max(n_heads, 1))
    if rope_dim is not None and int(rope_dim) != head:
        raise CheckpointError(f"{gguf.path}: {arch}.rope.dimension_count {rope_dim} is not the head size "
                              f"{head} (partial RoPE is not supported)")
    scaling = gguf.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"{gguf.path}: {arch}.rope.scaling.type {scaling!r} is not supported")
    return {
        "layers": int(_require(gguf, f"{arch}.block_count")), "d": d, "heads": n_heads,
        "kv_heads": int(gguf.get(f"{arch}.attention.head_count_kv") or n_heads),
        "ff": int(_require(gguf, f"{arch}.feed_forward_length")),
        "context": int(gguf.get(f"{arch}.context_length") or 4096),
        "rope_theta": float(gguf.get(f"{arch}.rope.freq_base") or 10000.0),
        "eps": float(gguf.get(f"{arch}.attention.layer_norm_rms_epsilon") or 1e-5), "rows": int(rows),
        "tied": "output.weight" not in gguf.tensor_names,
    }


def _special_ids(gguf) -> dict:
    out = {}
    for key, name in (("eos_token_id", "eos_token_id"), ("bos_token_id", "bos_token_id"),
                      ("padding_token_id", "pad_token_id"), ("mask_token_id", "mask_token_id")):
        value = gguf.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int) and not isinstance(value, bool):
            out[name] = value
    return out


def llada_config(gguf, arch: str = "llada") -> dict:
    """LLaDA's ``config.json`` (GSAI-ML/LLaDA-8B-Instruct's keys) from the GGUF metadata."""
    s = _common_shape(gguf, arch)
    ids = _special_ids(gguf)
    cfg = {
        "architectures": ["LLaDAModelLM"], "model_type": "llada", "activation_type": "silu", "alibi": False,
        "attention_layer_norm": False, "bias_for_layer_norm": False, "block_group_size": 1, "block_type": "llama",
        "d_model": s["d"], "embedding_size": s["rows"], "include_bias": False, "include_qkv_bias": False,
        "input_emb_norm": False, "layer_norm_type": "rms", "layer_norm_with_affine": True,
        "max_sequence_length": s["context"], "mlp_hidden_size": s["ff"], "n_heads": s["heads"],
        "n_kv_heads": s["kv_heads"], "n_layers": s["layers"], "rms_norm_eps": s["eps"], "rope": True,
        "rope_theta": s["rope_theta"], "scale_logits": False, "use_cache": False,
        "vocab_size": int(gguf.get(f"{arch}.vocab_size") or s["rows"]), "weight_tying": s["tied"],
    }
    cfg.update({k: v for k, v in ids.items() if k != "bos_token_id"})
    return cfg


def dream_config(gguf, arch: str = "dream") -> dict:
    """Dream's ``config.json`` (Dream-org/Dream-v0-Instruct-7B's keys: Qwen2's) from the GGUF metadata."""
    s = _common_shape(gguf, arch)
    cfg = {
        "architectures": ["DreamModel"], "model_type": "Dream", "hidden_act": "silu", "hidden_size": s["d"],
        "intermediate_size": s["ff"], "num_hidden_layers": s["layers"], "num_attention_heads": s["heads"],
        "num_key_value_heads": s["kv_heads"], "max_position_embeddings": s["context"], "rope_theta": s["rope_theta"],
        "rms_norm_eps": s["eps"], "vocab_size": s["rows"], "tie_word_embeddings": s["tied"],
        "use_sliding_window": False, "sliding_window": None, "use_cache": False,
    }
    cfg.update(_special_ids(gguf))
    return cfg


def llada_moe_config(gguf, arch: str = "llada-moe") -> dict:
    """LLaDA-MoE's ``config.json`` (inclusionAI/LLaDA-MoE-7B-A1B's keys, :mod:`.llada_moe`) from the GGUF metadata:
    ``{arch}.expert_count``, ``expert_used_count``, ``expert_feed_forward_length`` (else ``feed_forward_length /
    expert_used_count``, llama.cpp's fallback), ``attention.key_length`` (the head size)."""
    cfg = dream_config(gguf, arch)
    used = int(_require(gguf, f"{arch}.expert_used_count"))
    width = gguf.get(f"{arch}.expert_feed_forward_length") or cfg["intermediate_size"] // used
    cfg.update({"architectures": ["LLaDAMoEModelLM"], "model_type": "lladamoe", "num_experts_per_tok": used,
                "num_experts": int(_require(gguf, f"{arch}.expert_count")), "expert_intermediate_size": int(width),
                "head_dim": int(gguf.get(f"{arch}.attention.key_length") or cfg["hidden_size"] //
                                cfg["num_attention_heads"]), "norm_topk_prob": False})
    for key in ("use_sliding_window", "sliding_window"):
        cfg.pop(key, None)
    return cfg


def _read_tensors(gguf, top: dict[str, str], block_prefix: str, block: dict[str, str],
                  experts: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of the file under its family name (``top`` for whole-model tensors, ``block`` per layer;
    ``experts``: merged ``[E, ...]`` expert tensors split into ``mlp.experts.E.<name>.weight`` views).

    Raises:
        CheckpointError: a tensor the family does not have (names it and the file).
    """
    state, unknown = {}, []
    for name in gguf.tensor_names:
        m = _BLK.fullmatch(name)
        if name in top:
            state[top[name]] = gguf.tensor(name)
        elif m and m.group(2) in block:
            state[block_prefix.format(m.group(1)) + f"{block[m.group(2)]}.{m.group(3)}"] = gguf.tensor(name)
        elif m and experts and m.group(2) in experts:
            for e, t in enumerate(gguf.tensor(name)):
                state[block_prefix.format(m.group(1)) + f"mlp.experts.{e}.{experts[m.group(2)]}.weight"] = t
        else:
            unknown.append(name)
    if unknown:
        raise CheckpointError(f"{gguf.path}: tensors {gguf.get('general.architecture')} does not have: "
                              f"{unknown[:4]}{' ...' if len(unknown) > 4 else ''}")
    return state


def _unpermute_qk(state: dict[str, torch.Tensor], n_heads: int, n_kv_heads: int) -> None:
    """Undo llama.cpp's RoPE permutation of LLaDA's q and k rows in place (module docstring, (*))."""
    for name, t in list(state.items()):
        heads = n_heads if ".q_proj." in name else n_kv_heads if ".k_proj." in name else None
        if heads is None:
            continue
        rows = t.shape[0]
        state[name] = (t.reshape(heads, rows // heads // 2, 2, *t.shape[1:]).transpose(1, 2)
                       .reshape(t.shape).contiguous())


def _check_blocks(gguf, state: dict, config: dict, family: str) -> None:
    """Every layer ``0..block_count-1`` is present and no other (a file cut short in its tensor list)."""
    n = int(config.get("n_layers") or config.get("num_hidden_layers") or 0)
    layers = {int(m.group(1)) for k in state for m in [re.search(r"\.(?:blocks|layers)\.(\d+)\.", k)] if m}
    if layers != set(range(n)):
        missing = sorted(set(range(n)) - layers)
        extra = sorted(layers - set(range(n)))
        raise CheckpointError(f"{gguf.path}: {family} block_count is {n} but the file's layers are "
                              f"{'missing ' + str(missing[:4]) if missing else ''}"
                              f"{' extra ' + str(extra[:4]) if extra else ''}")


def gguf_tokenizer(gguf):
    """The tokenizer the file describes (vocabulary, merges, token types, special ids, chat template), built by
    transformers' GGUF tokenizer builder; its ``name_or_path`` is the file.

    Raises:
        CheckpointError: no vocabulary in the file, or one transformers cannot build (names the tokenizer model).
    """
    from transformers import PreTrainedTokenizerFast

    if not gguf.get("tokenizer.ggml.tokens"):
        raise CheckpointError(f"{gguf.path}: tokenizer.ggml.tokens is missing (the GGUF holds no vocabulary)")
    try:
        tok = PreTrainedTokenizerFast.from_pretrained(str(gguf.path.parent), gguf_file=gguf.path.name)
    except Exception as exc:
        raise CheckpointError(f"{gguf.path}: cannot build the tokenizer (tokenizer.ggml.model "
                              f"{gguf.get('tokenizer.ggml.model')!r}: {' '.join(str(exc).split())[:160]})") from exc
    template = gguf.get("tokenizer.chat_template")
    if isinstance(template, str) and template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    return tok
