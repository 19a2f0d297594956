"""``llada2``: inclusionAI LLaDA2.x (LLaDA2.0-mini 16B-A1.4B, -flash 100B, LLaDA2.1-mini/flash; MoE block diffusion)
checkpoints, loaded without remote code onto :class:`~unmask.engine.llada2_model.Llada2ForDiffusion`.

``LLaDA2MoeModelLM`` (``model_type: llada2_moe``) checkpoints name their tensors (checked against the
LLaDA2.0-mini config and safetensors index and the public modeling code):

==================================================================  =====================================
checkpoint                                                          here
==================================================================  =====================================
``model.word_embeddings.weight``                                    the same
``model.layers.N.{input,post_attention}_layernorm.weight``          the same
``model.layers.N.attention.query_key_value.{weight,bias}``          the same (bias with ``use_qkv_bias``)
``model.layers.N.attention.{query,key}_layernorm.weight``           the same (``use_qk_norm``)
``model.layers.N.attention.dense.weight``                           the same
``model.layers.N.mlp.{gate,up,down}_proj.weight``                   the same (the first ``first_k_dense_replace``)
``model.layers.N.mlp.gate.weight`` / ``.expert_bias``               the router (``[E, H]`` / ``[E]``)
``model.layers.N.mlp.experts.E.{gate,up,down}_proj.weight``         stacked: ``mlp.experts.{gate,up,down}_proj``
``model.layers.N.mlp.shared_experts.{gate,up,down}_proj.weight``    the same (``num_shared_experts``)
``model.norm.weight``, ``lm_head.weight``                           the same
==================================================================  =====================================

A checkpoint whose experts or router do not match its ``config.json`` (an expert index past ``num_experts``, a
missing expert, a router of another shape) is refused in one line naming the tensor and its file.

Decoding settings (diffusers ``LLaDA2Pipeline`` / inclusionAI's ``generate``): block-causal attention with blocks of
32 (``block_length``; any block size may be requested) aligned to position 0, no logit shift, mask ``<|mask|>``
156895, EOS ``<|endoftext|>`` 156892 (plus ``<|role_end|>``), temperature 0, threshold 0.95; decoded by block
refinement (``unmask.engine.refinement``), token editing (LLaDA2.1) on request (``editing_threshold``).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ..config import CheckpointError, DllmConfig, read_json_file
from . import FamilyAdapter
from .common import (default_temperature, load_tokenizer_without_remote_code, max_context_of, positive_int,
                     read_state_dict, resolve_eos_token_ids, resolve_mask_token_id, resolve_pad_token_id, unused_rows)

ARCHITECTURE = "LLaDA2MoeModelLM"
MODEL_TYPE = "llada2_moe"
MASK_TOKENS = ("<|mask|>",)
END_TOKENS = ("<|endoftext|>", "<|role_end|>")
DEFAULT_MASK_ID = 156895
DEFAULT_EOS_IDS = [156892]
DEFAULT_BLOCK_SIZE = 32  # generate(block_length=32)
DEFAULT_THRESHOLD = 0.95  # generate(threshold=0.95), BlockRefinementScheduler(threshold=0.95)
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# (key, value this architecture needs, why)
_REQUIRED = (("hidden_act", "silu", "the experts and MLPs are SwiGLU"),
             ("use_bias", False, "the output projection has no bias here"),
             ("norm_head", False, "a normalised LM head is not implemented"),
             ("rope_scaling", None, "RoPE scaling is not implemented"))


def detect(config: dict) -> bool:
    """``architectures`` contains ``LLaDA2MoeModelLM`` or ``model_type == "llada2_moe"``."""
    return ARCHITECTURE in (config.get("architectures") or []) or config.get("model_type") == MODEL_TYPE


def llada2_config(config: dict, path: Path | str = ""):
    """The :class:`~unmask.engine.llada2_model.Llada2Config` of a LLaDA2 ``config.json``.

    Raises:
        CheckpointError: a missing or out-of-range key, an option this architecture does not implement (names it).
    """
    from ..llada2_model import Llada2Config

    where = Path(path) / "config.json"
    for key, value, why in _REQUIRED:
        if config.get(key, value) != value:
            raise CheckpointError(f"{where}:{key}: {config.get(key)!r} is not supported ({why}; expected {value!r})")
    kwargs = {k: config[k] for k in Llada2Config.keys() if config.get(k) is not None}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_experts",
                "num_experts_per_tok", "moe_intermediate_size"):
        if key not in kwargs:
            raise CheckpointError(f"{where}: missing `{key}` (not a LLaDA2 MoE config?)")
        positive_int(config, key, 1, path)
    kwargs.setdefault("num_key_value_heads", kwargs["num_attention_heads"])
    kwargs.setdefault("head_dim", kwargs["hidden_size"] // kwargs["num_attention_heads"])
    kwargs.setdefault("intermediate_size", kwargs["moe_intermediate_size"])
    if kwargs["num_attention_heads"] % kwargs["num_key_value_heads"]:
        raise CheckpointError(f"{where}:num_key_value_heads: {kwargs['num_key_value_heads']} does not divide "
                              f"num_attention_heads {kwargs['num_attention_heads']}")
    cfg = Llada2Config(**kwargs)
    try:
        cfg.moe_spec()
    except ValueError as exc:
        raise CheckpointError(f"{where}:{exc}") from None
    return cfg


def _file_of(path: Path, name: str) -> Path:
    """The safetensors file that holds tensor ``name`` (the shard the index names, else ``model.safetensors``)."""
    index = read_json_file(path / "model.safetensors.index.json") or {}
    shard = (index.get("weight_map") or {}).get(name)
    return path / (shard or "model.safetensors")


def model_state(state: dict[str, torch.Tensor], cfg, path: Path | str = "") -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in :class:`Llada2ForDiffusion`'s names (experts stacked per layer), with the
    expert count and the router's shape checked against ``cfg``. The per-expert tensors are taken out of ``state``
    as they are stacked (peak memory: the checkpoint plus one layer's projection).

    Raises:
        CheckpointError: one line naming the tensor and its file: an expert index past ``num_experts``, a missing
            expert, a router of another shape.
    """
    path = Path(path)
    E, H = cfg.num_experts, cfg.hidden_size
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str], list[int]] = {}
    for name in list(state):
        m = _EXPERT.fullmatch(name)
        if m is None:
            out[name] = state[name]
            continue
        layer, e, proj = int(m.group(1)), int(m.group(2)), m.group(3)
        if e >= E:
            raise CheckpointError(f"{_file_of(path, name)}: tensor {name}: expert {e} but config.json says "
                                  f"num_experts {E}")
        experts.setdefault((layer, proj), []).append(e)
    for (layer, proj), found in sorted(experts.items()):
        if len(found) != E:
            missing = min(set(range(E)) - set(found))
            raise CheckpointError(f"{path}: tensor model.layers.{layer}.mlp.experts.{missing}.{proj}.weight is "
                                  f"missing: config.json says num_experts {E}, the checkpoint has {len(found)}")
        # one projection of one layer at a time, its per-expert tensors freed as they are stacked: the peak is the
        # checkpoint plus one layer's projection, not two copies of every expert
        names = [f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight" for e in range(E)]
        out[f"model.layers.{layer}.mlp.experts.{proj}"] = torch.stack([state.pop(n) for n in names])
    for layer in range(cfg.first_k_dense_replace, cfg.num_hidden_layers):
        name = f"model.layers.{layer}.mlp.gate.weight"
        router = out.get(name)
        if router is not None and tuple(router.shape) != (E, H):
            raise CheckpointError(f"{_file_of(path, name)}: tensor {name} has shape {list(router.shape)}, expected "
                                  f"[{E}, {H}] (num_experts x hidden_size in config.json)")
        out.setdefault(f"model.layers.{layer}.mlp.gate.expert_bias", torch.zeros(E))
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out


def checkpoint_state(model) -> dict[str, torch.Tensor]:
    """The tensors of a :class:`Llada2ForDiffusion` in the checkpoint's names (experts one by one): what
    :func:`model_state` reads back (tests and benchmarks save replicas with it)."""
    out = {}
    for name, tensor in model.state_dict().items():
        m = re.fullmatch(r"(model\.layers\.\d+\.mlp\.experts)\.(gate_proj|up_proj|down_proj)", name)
        if m is None:
            if not (name == "lm_head.weight" and model.config.tie_word_embeddings):
                out[name] = tensor.contiguous()
            continue
        for e in range(tensor.shape[0]):
            out[f"{m.group(1)}.{e}.{m.group(2)}.weight"] = tensor[e].contiguous()
    return out


def build_model(cfg, state: dict[str, torch.Tensor], path: Path | str, device: torch.device, dtype: torch.dtype):
    """A :class:`Llada2ForDiffusion` holding ``state`` (:func:`model_state`'s names), built on the meta device
    (no second copy of the weights), in ``dtype`` on ``device``.

    Raises:
        CheckpointError: a missing, unexpected or misshapen tensor (one line, naming it and its file).
    """
    from ..llada2_model import Llada2ForDiffusion

    with torch.device("meta"):
        model = Llada2ForDiffusion(cfg)
    expected = model.state_dict()
    if cfg.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    for name, tensor in state.items():
        if name not in expected:
            raise CheckpointError(f"{_file_of(Path(path), name)}: unexpected tensor {name} (not in a LLaDA2 model "
                                  f"of this config.json)")
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{_file_of(Path(path), name)}: tensor {name} has shape {list(tensor.shape)}, "
                                  f"expected {list(expected[name].shape)} from config.json")
    missing = sorted(set(expected) - set(state))
    if missing:
        raise CheckpointError(f"{path}: tensors missing from the checkpoint: {missing[:5]}"
                              f"{' ...' if len(missing) > 5 else ''}")
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.word_embeddings.weight
    return model.to(device).eval()


def dllm_config(path: Path | str, config: dict, tokenizer, vocab_rows: int) -> DllmConfig:
    """The ``llada2`` family's :class:`DllmConfig` (ids from the checkpoint first, module docstring's settings)."""
    mask_id = resolve_mask_token_id(Path(path), config, tokenizer, MASK_TOKENS, DEFAULT_MASK_ID, vocab_rows)
    eos = resolve_eos_token_ids(Path(path), config, tokenizer, END_TOKENS, DEFAULT_EOS_IDS, vocab_rows)
    eos = [t for t in eos if t != mask_id] or eos
    block = positive_int(config, "block_length", DEFAULT_BLOCK_SIZE, Path(path))
    return DllmConfig(family="llada2", mask_token_id=mask_id, attention="block_causal", block_size=block,
                      logit_shift=False, eos_token_ids=eos, pad_token_id=resolve_pad_token_id(config, tokenizer, eos,
                                                                                              vocab_rows),
                      block_alignment="absolute",
                      default_sampling={"temperature": default_temperature(Path(path), 0.0),
                                        "threshold": DEFAULT_THRESHOLD},
                      suppress_token_ids=unused_rows(tokenizer, vocab_rows))


def load(path: Path, config: dict, device: torch.device, dtype: torch.dtype):
    """Load a LLaDA2.x checkpoint directory (module docstring).

    Raises:
        CheckpointError: an unsupported config option, weights that do not match it, a missing tokenizer or ids.
    """
    from ..loaded import LoadedModel

    path = Path(path)
    cfg = llada2_config(config, path)
    tokenizer = load_tokenizer_without_remote_code(path)
    dllm = dllm_config(path, config, tokenizer, cfg.vocab_size)
    model = build_model(cfg, model_state(read_state_dict(path), cfg, path), path, device, dtype)
    return LoadedModel(model=model, tokenizer=tokenizer, dllm=dllm, path=str(path), device=device, dtype=dtype,
                       max_context=max_context_of(config))


ADAPTER = FamilyAdapter(name="llada2", detect=detect, load=load)
