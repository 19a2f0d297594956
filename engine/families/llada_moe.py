"""``llada_moe``: LLaDA-MoE (inclusionAI/LLaDA-MoE-7B-A1B-Base/-Instruct) checkpoints, loaded without remote code.

The architecture is the one llama.cpp runs for ``llada-moe`` GGUF files (``src/models/llada-moe.cpp``; converter
``LLaDAMoEModel``), which this module follows: a Qwen3-MoE-style decoder with bidirectional attention. Per layer:
RMS norm, q/k/v projections (no bias), RMS norm of each head of q and of k (``self_attn.q_norm``/``k_norm``,
``head_dim`` wide), NeoX ("rotate half") RoPE, output projection; RMS norm, then a mixture of SwiGLU experts
(``mlp.gate`` router, ``mlp.experts.E.{gate,up,down}_proj``): softmax over the router logits, the
``num_experts_per_tok`` best experts weighed by their softmax probabilities (renormalised only when the config's
``norm_topk_prob`` is true: llama.cpp does not renormalise), no shared experts. The attention and norms are
transformers' :class:`~transformers.Qwen3MoeForCausalLM`; the MoE layer is unmask's (:mod:`unmask.engine.moe`,
grouped GEMMs per expert), built with ``score_function="softmax"``.

Config keys: ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``
(else ``hidden_size / num_attention_heads``), ``num_experts``, ``num_experts_per_tok``,
``expert_intermediate_size`` (else ``moe_intermediate_size``), ``norm_topk_prob``, ``rope_theta``,
``rms_norm_eps``, ``max_position_embeddings``, ``vocab_size``, ``tie_word_embeddings``; shared experts, biases and
RoPE scaling are refused naming the key. Decoding: bidirectional, no logit shift, mask id 156895 (llama.cpp's
converter writes it), block 32, temperature 0; ids are read from the checkpoint first.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ..config import CheckpointError
from . import FamilyAdapter
from .common import build_foreign_model, declares, positive_int, read_state_dict

ARCHITECTURES = ("LLaDAMoEModelLM", "LLaDAMoEModel")
MODEL_TYPES = ("lladamoe", "llada_moe", "llada-moe")
MASK_TOKENS = ("<|mask|>", "<|mdm_mask|>")
END_TOKENS = ("<|endoftext|>", "<|role_end|>", "<|eot_id|>")
DEFAULT_MASK_ID = 156895  # llama.cpp conversion/llada.py LLaDAMoEModel: add_mask_token_id(156895)
DEFAULT_BLOCK_SIZE = 32
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def detect(config: dict) -> bool:
    """``architectures`` names ``LLaDAMoEModelLM`` / ``LLaDAMoEModel`` or ``model_type`` is ``lladamoe``."""
    return declares(config, ARCHITECTURES, MODEL_TYPES)


def moe_shape(config: dict, path: Path | str = "") -> dict:
    """The sizes of a LLaDA-MoE ``config.json`` (module docstring).

    Raises:
        CheckpointError: a missing or non-positive size, or an option this architecture does not have (names it).
    """
    where = Path(path) / "config.json"
    for key in ("num_shared_experts", "n_shared_experts"):
        if config.get(key):
            raise CheckpointError(f"{where}:{key}: shared experts are not part of LLaDA-MoE")
    for key in ("attention_bias", "qkv_bias", "mlp_bias"):
        if config.get(key):
            raise CheckpointError(f"{where}:{key}: biases are not part of LLaDA-MoE")
    if config.get("rope_scaling") not in (None, {}):
        raise CheckpointError(f"{where}:rope_scaling: RoPE scaling is not supported")
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts_per_tok"):
        if key not in config:
            raise CheckpointError(f"{where}: missing `{key}` (not a LLaDA-MoE config?)")
    hidden = positive_int(config, "hidden_size", 1, path)
    heads = positive_int(config, "num_attention_heads", 1, path)
    experts = config.get("num_experts", config.get("num_local_experts"))
    width = config.get("expert_intermediate_size", config.get("moe_intermediate_size"))
    for key, value in (("num_experts", experts), ("expert_intermediate_size", width)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{where}:{key}: must be a positive integer, got {value!r}")
    return {"hidden": hidden, "layers": positive_int(config, "num_hidden_layers", 1, path), "heads": heads,
            "kv_heads": positive_int(config, "num_key_value_heads", heads, path),
            "head_dim": positive_int(config, "head_dim", hidden // heads, path), "experts": int(experts),
            "top_k": positive_int(config, "num_experts_per_tok", 1, path), "width": int(width),
            "norm_topk_prob": bool(config.get("norm_topk_prob", False))}


def qwen3_moe_config(config: dict, shape: dict):
    """The transformers ``Qwen3MoeConfig`` of the attention and norms (every layer sparse)."""
    from transformers import Qwen3MoeConfig

    rows = config.get("vocab_size")
    cfg = Qwen3MoeConfig(
        vocab_size=int(rows), hidden_size=shape["hidden"], intermediate_size=int(config.get("intermediate_size") or 1),
        moe_intermediate_size=shape["width"], num_experts=shape["experts"], num_experts_per_tok=shape["top_k"],
        norm_topk_prob=shape["norm_topk_prob"], decoder_sparse_step=1, mlp_only_layers=[],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        rope_theta=float(config.get("rope_theta", 10000.0)), rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)), attention_bias=False, use_cache=False,
        bos_token_id=None, eos_token_id=config.get("eos_token_id"), pad_token_id=config.get("pad_token_id"))
    cfg._attn_implementation = "sdpa"
    return cfg


def stack_experts(state: dict[str, torch.Tensor], shape: dict, path: Path | str = "") -> dict[str, torch.Tensor]:
    """Per-expert tensors ``mlp.experts.E.{gate,up,down}_proj.weight`` stacked into the MoE layer's
    ``mlp.experts.{gate,up,down}_proj`` ``[E, ...]``; the router gains its ``expert_bias`` (zeros: LLaDA-MoE has
    none). Other names pass unchanged.

    Raises:
        CheckpointError: an expert missing in a layer (names the first).
    """
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, t in state.items():
        m = _EXPERT.fullmatch(name)
        if m:
            experts.setdefault((int(m.group(1)), m.group(3)), {})[int(m.group(2))] = t
        else:
            out[name] = t
    for (layer, proj), parts in sorted(experts.items()):
        missing = sorted(set(range(shape["experts"])) - set(parts))
        if missing or len(parts) != shape["experts"]:
            raise CheckpointError(f"{path}: layer {layer} {proj}: experts {missing[:4] or sorted(parts)[-1:]} "
                                  f"do not match num_experts {shape['experts']}")
        out[f"model.layers.{layer}.mlp.experts.{proj}"] = torch.stack([parts[e] for e in range(shape["experts"])])
    for layer in range(shape["layers"]):
        out.setdefault(f"model.layers.{layer}.mlp.gate.expert_bias", torch.zeros(shape["experts"]))
    return out


def build_model(hf_config, shape: dict, state: dict[str, torch.Tensor], path: Path, device, dtype):
    """``Qwen3MoeForCausalLM`` with :class:`~unmask.engine.moe.MoeLayer` feed-forwards, ``state`` loaded strictly.

    Raises:
        CheckpointError: missing, unexpected or misshapen tensors (names the first few).
    """
    from transformers import Qwen3MoeForCausalLM
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding

    from ..moe import MoeLayer, MoeSpec

    spec = MoeSpec(hidden=shape["hidden"], intermediate=shape["width"], num_experts=shape["experts"],
                   top_k=shape["top_k"], score_function="softmax", norm_topk_prob=shape["norm_topk_prob"])
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(hf_config)
        for layer in model.model.layers:
            layer.mlp = MoeLayer(spec)
    state = dict(state)
    if hf_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()
                if not (hf_config.tie_word_embeddings and k == "lm_head.weight")}
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise CheckpointError(f"{path}: LLaDA-MoE weights do not match: missing {missing[:4]}, unexpected "
                              f"{unexpected[:4]}")
    for name, t in state.items():
        if tuple(t.shape) != expected[name]:
            raise CheckpointError(f"{path}: tensor {name} has shape {tuple(t.shape)}, expected {expected[name]}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if hf_config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = Qwen3MoeRotaryEmbedding(config=hf_config)  # its inv_freq is not in the checkpoint
    return model.to(device).eval()


def load(path: Path, config: dict, device: torch.device, dtype: torch.dtype, state_dict=None, tokenizer=None):
    """Load a LLaDA-MoE checkpoint directory (``state_dict``/``tokenizer`` in memory replace the directory's: a GGUF
    file's, :mod:`.gguf_diffusion`).

    Raises:
        CheckpointError: an unsupported option, weights that do not match, missing tokenizer or ids.
    """
    path = Path(path)
    shape = moe_shape(config, path)
    if not isinstance(config.get("vocab_size"), int) or config["vocab_size"] < 1:
        raise CheckpointError(f"{path / 'config.json'}: missing `vocab_size`")
    hf_config = qwen3_moe_config(config, shape)
    state = stack_experts(read_state_dict(path) if state_dict is None else state_dict, shape, path)
    return build_foreign_model(
        path, config, device, dtype, family="llada_moe", arch="Qwen3MoeForCausalLM", hf_config=hf_config,
        state_dict=state, mask_tokens=MASK_TOKENS, default_mask=DEFAULT_MASK_ID, end_tokens=END_TOKENS,
        default_eos=[], attention="bidirectional", block_size=DEFAULT_BLOCK_SIZE, logit_shift=False,
        family_temperature=0.0, tokenizer=tokenizer,
        build=lambda cfg, sd, dev, dt: build_model(cfg, shape, sd, path, dev, dt),
    )


ADAPTER = FamilyAdapter(name="llada_moe", detect=detect, load=load)
