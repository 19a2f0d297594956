"""``sdar``: JetAstra SDAR (JetLM/SDAR-1.7B/4B/8B-Chat, dense) checkpoints, loaded without remote code.

``SDARForCausalLM`` (``model_type: sdar``) is Qwen3 trained for block diffusion: the same parameter names
(``self_attn.{q,k,v,o}_proj`` without bias, per-head ``q_norm``/``k_norm``, ``mlp.{gate,up,down}_proj``,
``model.embed_tokens``, ``model.norm``, ``lm_head``) and config keys (``head_dim``, ``rope_theta``, ...) plus
``block_size`` (4) and ``mask_token_id`` (151669), checked against ``modeling_sdar.py`` and
``SDAR-4B-Chat/config.json`` / ``model.safetensors.index.json`` in JetAstra/SDAR. The weights load strictly onto
:class:`~transformers.Qwen3ForCausalLM`.

Decoding settings (SDAR ``generate.py`` ``block_diffusion_generate``): block-causal attention (``tril`` over
blocks) with blocks aligned to position 0 (the prompt's last partial block is completed first), fixed block size
from config ``block_size``, no logit shift (the logits of a block's own positions are used), mask ``<|MASK|>``
151669, stop ids from ``generation_config.json`` ``eos_token_id`` (``<|im_end|>`` 151645, ``<|endoftext|>``
151643); temperature from ``generation_config.json`` when it samples, else 1.0 (``generate.py`` default).
"""
from __future__ import annotations

from pathlib import Path

import torch

from . import FamilyAdapter
from .common import build_foreign_model, declares, positive_int, qwen_style_config, read_state_dict

ARCHITECTURE = "SDARForCausalLM"
MASK_TOKENS = ("<|MASK|>",)
END_TOKENS = ("<|im_end|>", "<|endoftext|>")
DEFAULT_MASK_ID = 151669
DEFAULT_EOS_IDS = [151645, 151643]
DEFAULT_BLOCK_SIZE = 4


def detect(config: dict) -> bool:
    """``architectures`` contains ``SDARForCausalLM`` or ``model_type == "sdar"``."""
    return declares(config, (ARCHITECTURE,), ("sdar",))


def load(path: Path, config: dict, device: torch.device, dtype: torch.dtype):
    """Load an SDAR checkpoint directory as a ``Qwen3ForCausalLM`` with block-causal decoding settings.

    Raises:
        CheckpointError: bad ``block_size``, weights that do not match Qwen3, missing tokenizer or ids.
    """
    from transformers import Qwen3Config

    path = Path(path)
    block = positive_int(config, "block_size", DEFAULT_BLOCK_SIZE, path)
    hf_config = qwen_style_config(Qwen3Config, config)
    return build_foreign_model(
        path, config, device, dtype, family="sdar", arch="Qwen3ForCausalLM", hf_config=hf_config,
        state_dict=read_state_dict(path), mask_tokens=MASK_TOKENS, default_mask=DEFAULT_MASK_ID,
        end_tokens=END_TOKENS, default_eos=DEFAULT_EOS_IDS, attention="block_causal", block_size=block,
        logit_shift=False, block_alignment="absolute", fixed_block_size=True, family_temperature=1.0,
        tokenizer_fallbacks=("Qwen2Tokenizer", "Qwen2TokenizerFast"),
    )


ADAPTER = FamilyAdapter(name="sdar", detect=detect, load=load)
